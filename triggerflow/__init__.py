"""triggerflow: deferrable triggers on RabbitMQ, with PostgreSQL as the durable record."""

__version__ = "0.1.0"
