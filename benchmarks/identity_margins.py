"""How close the run-time identity check's differences come to its tolerance, under bf16.

Per configuration, ``STEPS`` training steps of a tiny model from a config (BERT classifier,
GPT-2, Llama; vocabulary 40) read with ``PerSampleStats(check_identity="always")``; printed: the
largest |per-example sum - delivered| / bound over every parameter and step (the bound with R
itself, as the check's slow path computes it), and for the BERT classifier the smallest L2
penalty on its weight, as a multiple of the data gradient's norm, that the check raises on.
A margin well below 1 on normal steps means no false alarm; the penalty ratio is what the check
can see. Run: ``python -m benchmarks.identity_margins``.
"""

from __future__ import annotations

import torch

from grabkit.stats import IdentityCheckError, PerSampleStats
from grabkit.stats import identity as identity_module

STEPS = 10
B, T = 6, 8

_worst: list[float] = []


def _recording_failures(self, numbers):
    """``_Comparison.failures``, recording each parameter's difference over its bound."""
    factor_side, _, gradient_side = numbers
    for k in range(len(self.names)):
        pairs = zip(self.constants, self.segments, strict=True)
        bound = sum(c * float(s.magnitude()) for c, s in pairs if s.index == k)
        if bound > 0:
            _worst.append(abs(factor_side[k] - gradient_side[k]) / bound)
    return _failures(self, numbers)


_failures = identity_module._Comparison.failures


def _model(kind: str) -> torch.nn.Module:
    from tests.integrations.tiny import tiny_bert, tiny_gpt2, tiny_llama

    return {"bert": tiny_bert, "gpt2": tiny_gpt2, "llama": tiny_llama}[kind]()


def _loss(model, kind: str, step: int, penalty: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 40, (B, T if kind != "bert" else 6), generator=g)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    if kind == "bert":
        labels = torch.randint(0, 2, (B,), generator=g)
        loss = model(input_ids=ids, position_ids=positions, labels=labels).loss.float()
        return loss + penalty * model.classifier.weight.float().square().sum()
    return model(input_ids=ids, position_ids=positions, labels=ids).loss.float()


def margin(kind: str, params_dtype: torch.dtype, autocast: bool) -> float:
    """The largest difference / bound over ``STEPS`` steps of normal training."""
    model = _model(kind).to(params_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _worst.clear()
    with PerSampleStats(model, check_identity="always") as stats:
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = _loss(model, kind, step)
            loss.backward()
            stats.norms_squared()
            optimizer.step()
            optimizer.zero_grad()
    return max(_worst)


def smallest_caught_penalty(autocast: bool) -> float:
    """|penalty gradient| / |data gradient| of the classifier at the smallest penalty caught."""
    for penalty in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0):
        model = _model("bert")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            data_loss = _loss(model, "bert", 0)
        data = torch.autograd.grad(data_loss, model.classifier.weight)[0].norm()
        with PerSampleStats(model, check_identity="always") as stats:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = _loss(model, "bert", 0, penalty)
            loss.backward()
            try:
                stats.norms_squared()
            except IdentityCheckError:
                return float(2 * penalty * model.classifier.weight.detach().norm() / data)
    return float("inf")


def main() -> None:
    identity_module._Comparison.failures = _recording_failures
    for kind in ("bert", "gpt2", "llama"):
        for dtype, autocast in (
            (torch.float32, False),
            (torch.float32, True),
            (torch.bfloat16, True),
        ):
            label = (
                f"{kind} params {str(dtype)[6:]}, {'bf16 autocast' if autocast else 'no autocast'}"
            )
            print(f"{label}: max difference / bound {margin(kind, dtype, autocast):.3g}")
    for autocast in (False, True):
        print(
            f"bert classifier, {'bf16 autocast' if autocast else 'float32'}: smallest penalty "
            f"caught {smallest_caught_penalty(autocast):.3g} x the data gradient"
        )


if __name__ == "__main__":
    main()
