-- The W3C traceparent of the collect-now that created the request (NULL while tracing is off or for older rows):
-- the dispatch-coordinator reads it with the request's high tasks, so the dispatch of a click joins the click's
-- trace although the coordinator is woken by a NOTIFY, which carries no context.
ALTER TABLE monitoring_collect_requests ADD COLUMN traceparent varchar(55);
