"""qkv's core, between the kernels and the public functions: which code runs (``dispatch``),
how a mask or score modification becomes what a kernel eats (``lowering``), the tiled
kernel as one op inside ``torch.compile`` (``compiled``) and the recording of calls
(``record``)."""
