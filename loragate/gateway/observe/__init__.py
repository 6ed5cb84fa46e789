"""What the gateway tells about itself: request metrics and their exposition (``metrics``,
``metrics_scrape``), timing spans and OpenTelemetry tracing (``spans``, ``tracing``), the
recent traffic the status page draws (``traffic``) and the log tail (``log_tail``)."""
