"""A torch file over 4 GiB (zip64 offsets and sizes): dsckpt locates a tensor stored after the 4 GiB mark.

    python bench/check_large_file.py      # ~4.4 GiB on /tmp, ~10 s; too big for the test suite
"""
import os
import time

import torch

from dsckpt.formats.torchzip import TorchFile, read_tensor_bytes
p = os.environ.get("DSCKPT_BIG_FILE", "/tmp/dsckpt_big.pt")
big = torch.zeros((4_700_000_000 // 4,), dtype=torch.float32)
big[-5:] = torch.arange(5.0)
tail = torch.arange(1000, dtype=torch.float64)
torch.save({"head": torch.ones(3), "big": big, "tail": tail}, p)
del big
print("size", os.path.getsize(p))
t = time.time(); tf = TorchFile(p); print("parse s", round(time.time() - t, 3))
obj = tf.obj
got_tail = torch.frombuffer(bytearray(read_tensor_bytes(obj["tail"])), dtype=torch.float64)
assert torch.equal(got_tail, tail), "tail"
ref = obj["big"]
from dsckpt.formats.torchzip import tensor_byte_range
path, off, n = tensor_byte_range(ref)
with open(p, "rb") as fh:
    fh.seek(off + n - 20); last = torch.frombuffer(bytearray(fh.read(20)), dtype=torch.float32)
assert torch.equal(last, torch.arange(5.0)), last
print("zip64 offsets ok: big at", off, "nbytes", n, "tail after 4 GiB:", tensor_byte_range(obj["tail"])[1] > 2**32)
os.unlink(p)
