"""ddpkit.monitoring: per-rank metrics exported to Prometheus, and experiment trackers.

``prometheus.MetricsServer`` serves the job's per-rank metrics over HTTP (rank 0, off by default,
bound to loopback unless an address is given); ``trackers.open_trackers`` logs the config,
per-epoch metrics and the summary to MLflow and Weights & Biases through their own libraries
(rank 0). Each library is an optional extra: ``pip install 'ddpkit[prometheus,mlflow,wandb]'``.
"""
