"""What SGLang is, as the fleet sees it: its lifecycle, HTTP API, answers, logs, metrics, flags,
versions and pool arithmetic. Nothing here imports the tuner, delivery or the data set."""
