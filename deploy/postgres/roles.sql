-- The database roles of compose.yaml's deployment, as docs/security.md describes them: one
-- role per component, and each team's SDK and consumers on roles of their own, listed in
-- team_queue so that row security holds them to their queue. Run as the tables' owner after
-- `triggerflow db upgrade`; safe to run again (compose runs it on every `up`). Logins have
-- no passwords here because the demo's PostgreSQL trusts every connection: give them
-- passwords (or certificates) anywhere else.
DO $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['tf_sdk', 'tf_consumer', 'tf_writer', 'tf_ops'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) THEN
            EXECUTE format('CREATE ROLE %I LOGIN', name);
        END IF;
    END LOOP;
    -- Team roles hold their component's grants through membership.
    FOREACH name IN ARRAY ARRAY['tf_sdk_ml', 'tf_sdk_data_eng', 'tf_sdk_default'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) THEN
            EXECUTE format('CREATE ROLE %I LOGIN IN ROLE tf_sdk', name);
        END IF;
    END LOOP;
    FOREACH name IN ARRAY ARRAY['tf_consumer_ml', 'tf_consumer_data_eng', 'tf_consumer_default'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) THEN
            EXECUTE format('CREATE ROLE %I LOGIN IN ROLE tf_consumer', name);
        END IF;
    END LOOP;
END $$;

-- The grants of docs/security.md's table (GRANT is idempotent).
GRANT SELECT, INSERT, DELETE ON trigger TO tf_sdk;
GRANT SELECT, INSERT, UPDATE ON task_instance TO tf_sdk;
GRANT SELECT ON consumer TO tf_sdk;
GRANT USAGE ON SEQUENCE trigger_id_seq TO tf_sdk;
GRANT SELECT, UPDATE, DELETE ON trigger TO tf_consumer, tf_writer;
GRANT SELECT, UPDATE ON task_instance TO tf_consumer, tf_writer;
GRANT SELECT, INSERT, UPDATE, DELETE ON consumer TO tf_consumer, tf_writer;
GRANT SELECT, UPDATE, DELETE ON trigger_cancel_log TO tf_consumer;
GRANT SELECT, UPDATE ON trigger, task_instance TO tf_ops;
GRANT SELECT ON consumer TO tf_ops;

INSERT INTO team_queue (role, queue) VALUES
    ('tf_sdk_ml', 'team-ml'), ('tf_consumer_ml', 'team-ml'),
    ('tf_sdk_data_eng', 'team-data-eng'), ('tf_consumer_data_eng', 'team-data-eng'),
    ('tf_sdk_default', 'default'), ('tf_consumer_default', 'default')
ON CONFLICT DO NOTHING;
