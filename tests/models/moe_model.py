"""The DeepSpeed-MoE model of fixtures/make_moe_fixtures.py, for `--model moe_model:build_ep2` (and ep1)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
from make_moe_fixtures import build  # noqa: E402


def build_ep1():
    return build(ep_size=1)


def build_ep2():
    return build(ep_size=2)
