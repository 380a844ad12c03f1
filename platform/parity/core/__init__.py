"""The pieces every layer shares, with no dependency on any other parity package (only parity.types and
parity.errors): the device and compute dtype of a config, the sampling contract of every engine (SamplingSpec,
Engine), the batch layout every sampler shares, secret masking for anything written to disk or a tracking store,
and the per-layer torch.compile helpers that the trainer and the CUDA decode path both use."""
