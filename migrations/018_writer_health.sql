-- Write health of every writer of the monitoring database (ingest workers, projection workers, hubs), published
-- every few seconds by each replica: the p95 latency of its write transactions and how many of them failed on a
-- conflict (serialization failure, deadlock, lock timeout, unique violation) over its recent window. The
-- coordinator's auto slow-down reads the fresh rows (libs/db/write_health.py).
CREATE TABLE writer_health (
    writer      varchar(40)      NOT NULL,
    instance    varchar(200)     NOT NULL,
    p95_ms      double precision NOT NULL,
    writes      integer          NOT NULL,
    conflicts   integer          NOT NULL,
    updated_at  timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (writer, instance)
);
