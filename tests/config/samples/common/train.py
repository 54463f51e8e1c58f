# Shared training settings, imported by the other samples.
train = dict(
    train_iter=10,
    lr=1e-4,
    amp=False,
    output_dir="output",
    load_weight=None,
    dist=dict(data_parallel_size=1, tensor_parallel_size=1),
)
