"""consolidate and reshard over torch.distributed: torchrun (one or many hosts) or ``--nproc N``.

``group`` (processes, one verdict for all) · ``view`` (every process sees every file of the tag, its own or
a sparse copy) · ``transfer`` (the bytes a writer lacks, sent point to point over gloo) · ``outputs`` (which
processes share a filesystem, temp paths, publishing) · ``consolidate`` and ``reshard`` (the two drivers).
"""
