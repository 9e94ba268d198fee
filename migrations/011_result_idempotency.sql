-- A result post is idempotent per lease: the first body's digest is kept with the execution, so the same
-- body posted again (a client retrying after a lost answer) gets the same 202 and publishes nothing new,
-- and a different body on the same lease is refused (409). See docs/security.md, "Idempotent results".
ALTER TABLE desktop_tasks ADD COLUMN result_digest varchar(64);
