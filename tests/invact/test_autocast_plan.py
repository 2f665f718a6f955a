"""invact.planner.autocast: the rules the meta device's autocast casts by are torch's (an Autocast kernel is
registered for each rule's aten op), and on CPU they give the dtypes torch.autocast gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from invact.planner.autocast import ATEN, COMPOSITE, FP32, FP32_DTYPE, LOWER, Autocast

KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}
RULES = [
    (device, name) for device in KEYS for rules in (LOWER, FP32, FP32_DTYPE) for name in sorted(rules[device])
]


@pytest.mark.parametrize(("device", "name"), RULES, ids=[f"{d}-{n}" for d, n in RULES])
def test_each_rule_is_one_torch_registers(device, name):
    op = "aten::" + ATEN.get(name, name)
    registered = torch._C._dispatch_has_kernel_for_dispatch_key(op, KEYS[device])
    assert registered != (name in COMPOSITE[device]), f"{op}: {KEYS[device]} kernel {registered}"


def _linear(x, w):
    return F.linear(x, w)


# (what a model calls, its arguments' dtypes): every CPU rule these models meet, and ops autocast leaves
CALLS = {
    "linear": (_linear, (torch.float32, torch.float32)),
    "linear, 16-bit input": (_linear, (torch.bfloat16, torch.float32)),
    "matmul": (torch.matmul, (torch.float32, torch.float32)),
    "@": (lambda a, b: a @ b, (torch.float32, torch.float32)),
    "bmm": (lambda a, b: torch.bmm(a[None], b[None]), (torch.float32, torch.float32)),
    "sdpa": (
        lambda a, b: F.scaled_dot_product_attention(a[None], b[None], b[None]),
        (torch.float32, torch.float32),
    ),
    "cross_entropy": (
        lambda a, b: F.cross_entropy(a, torch.zeros(a.shape[0], dtype=torch.long)),
        (torch.bfloat16, None),
    ),
    "prod": (lambda a, b: torch.prod(a), (torch.bfloat16, None)),
    "softmax (no rule on CPU)": (lambda a, b: F.softmax(a, -1), (torch.bfloat16, None)),
    "layer_norm (no rule on CPU)": (lambda a, b: F.layer_norm(a, (8,)), (torch.bfloat16, None)),
    "mul (no rule)": (lambda a, b: a * b, (torch.float32, torch.bfloat16)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_cpu_rules_give_torch_autocasts_dtypes(call):
    f, dtypes = CALLS[call]
    args = [torch.ones(8, 8, dtype=d) if d is not None else None for d in dtypes]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = f(*args).dtype
    with Autocast("cpu") as autocast, autocast.region():
        assert f(*args).dtype == expected


def test_a_weight_is_cast_once_per_region_and_kept_to_its_end():
    w = torch.nn.Parameter(torch.ones(8, 8, device="meta"))
    x = torch.ones(2, 8, device="meta")
    with Autocast("cuda") as autocast:
        with autocast.region():
            F.linear(x, w)
            F.linear(x, w)
            assert len(autocast.cache) == 1 and autocast.cache[id(w)][1].dtype == torch.bfloat16
            assert torch.is_autocast_enabled("meta") and torch.get_autocast_dtype("meta") == torch.bfloat16
        assert not autocast.cache and not torch.is_autocast_enabled("meta")
        assert F.linear(x, w).dtype == torch.float32  # outside a region: no cast


class _Rotary(torch.nn.Module):
    """transformers 4.x's rotary embeddings: a float32 region opened on the input's device type."""

    def forward(self, x, w):
        with torch.autocast(device_type=x.device.type, enabled=False):
            inside = F.linear(x.float(), w.float())
        return inside, F.linear(x, w)


@pytest.mark.parametrize("active", [True, False], ids=["under the planner's autocast", "no autocast"])
def test_an_autocast_region_on_meta_tensors(active):
    # torch refuses device_type "meta" (RuntimeError); under meta_regions the region turns the planner's
    # Autocast off for its body (float32 there, bf16 after it) and is a no-op without one.
    from invact.planner.autocast import meta_regions

    x, w = torch.empty(4, 8, device="meta"), torch.empty(16, 8, device="meta", requires_grad=True)
    with pytest.raises(RuntimeError):
        _Rotary()(x, w)
    with meta_regions():
        if active:
            with Autocast("cuda") as autocast, autocast.region():
                inside, after = _Rotary()(x, w)
        else:
            inside, after = _Rotary()(x, w)
    assert inside.dtype == torch.float32
    assert after.dtype == (torch.bfloat16 if active else torch.float32)
    assert torch.autocast is torch.amp.autocast_mode.autocast  # torch's own again
