"""The MNIST job of ``ddpkit train``: config, data, model, the job itself, its outputs."""
