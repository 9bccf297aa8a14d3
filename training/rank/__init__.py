"""The parts of the rank program (training/worker.py), each with one job: setup, model,
resume, data, callbacks (and the callbacks' own modules: schedule, divergence, checkpointing,
meters), metrics, curves. Only ``config`` (WorkerConfig) and ``run_dir`` are imported outside
a rank; the others import TensorFlow and Horovod."""
