"""Slow, obvious references for the orderings: one example at a time, explicit float64 vectors.

Each reference replays one epoch: given the dataset's gradient table X (n, d), the epoch's order
and the batch sizes used to step it, it recomputes every balance vector explicitly and decides
each sign with a plain loop, then places +1 at the front (visit order) and -1 at the back
(reverse visit order). Random draws mirror the sampler's: one uniform per decision, in decision
order, from a stream seeded like the sampler's.
"""

from __future__ import annotations

import torch

from grabkit.order.balance import _mix
from grabkit.order.orderings import ORDERINGS


def own_options(kind: str, **options):
    """The options ``kind`` declares, out of ``options`` (the others would be refused)."""
    return {k: v for k, v in options.items() if k in ORDERINGS[kind].option_names()}


class RefRule:
    """The sign rule, written out: deterministic, or the walk with a fixed or running-max c."""

    def __init__(self, probabilistic: bool, c: float | None, seed: int, epoch: int) -> None:
        self.probabilistic, self.c = probabilistic, c
        self.g = torch.Generator().manual_seed(_mix(seed, epoch, 0x5EED))
        self.largest = 0.0
        self.pool: list[float] = []

    def draw(self, count: int) -> None:
        """Make sure ``count`` uniforms are ready; the stream is drawn in blocks of 256."""
        while self.probabilistic and len(self.pool) < count:
            self.pool += torch.rand(256, generator=self.g, dtype=torch.float64).tolist()

    def sign(self, s: torch.Tensor, z: torch.Tensor) -> float:
        v = float(s @ z)
        if not self.probabilistic:
            return 1.0 if v < 0 else -1.0
        if self.c is None:
            self.largest = max(self.largest, abs(v))
            c = self.largest
        else:
            c = self.c
        p = 0.5 if c == 0 else min(1.0, max(0.0, 0.5 - v / (2 * c)))
        return 1.0 if self.pool.pop(0) < p else -1.0


def batches_of(order: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for b in sizes:
        out.append(order[start : start + b])
        start += b
    return out


def front_back(order: list[int], front: list[int], back: list[int]) -> list[int]:
    placed = set(front) | set(back)
    return front + [i for i in order if i not in placed] + back[::-1]


class ReferenceBalancer:
    """State carried between epochs by the reference (stale mean, EMAs) for one balance_type."""

    def __init__(self, kind: str, *, probabilistic=False, c=None, seed=0, depth=2, ema_decay=0.1):
        self.kind, self.probabilistic, self.c, self.seed = kind, probabilistic, c, seed
        self.depth, self.rate = depth, ema_decay
        self.stale_mean: torch.Tensor | None = None
        self.ema_m = self.ema_v = None
        self.ema_t = 0
        self.v_scale: torch.Tensor | None = None

    @staticmethod
    def _update_ema(raw, x, r, t):
        """Bias-corrected EMA with newest weight r: (new raw value, corrected value)."""
        raw = r * x if raw is None else (1 - r) * raw + r * x
        return raw, raw / (1 - (1 - r) ** t)

    def epoch(self, X: torch.Tensor, order: list[int], sizes: list[int], epoch: int) -> list[int]:
        rule = RefRule(self.probabilistic, self.c, self.seed, epoch)
        d = X.shape[1]
        m = torch.zeros(d, dtype=X.dtype) if self.stale_mean is None else self.stale_mean
        visited = [i for b in batches_of(order, sizes) for i in b]
        method = getattr(self, "_balance_" + self.kind.replace("-", "_"))
        nxt = method(X, order, batches_of(order, sizes), m, rule)
        if visited:
            self.stale_mean = X[visited].mean(dim=0)
        return nxt

    def _flat(self, X, order, batches, rule, make_z, parallel=False):
        s = torch.zeros(X.shape[1], dtype=X.dtype)
        front, back = [], []
        for b in batches:
            Z = make_z(b)
            rule.draw(len(b))
            start = s.clone()
            for i, z in zip(b, Z, strict=True):
                eps = rule.sign(start if parallel else s, z)
                s = s + eps * z
                (front if eps > 0 else back).append(i)
        return front_back(order, front, back)

    def _balance_mean(self, X, order, batches, m, rule):
        return self._flat(X, order, batches, rule, lambda b: X[b] - m)

    def _balance_batch(self, X, order, batches, m, rule):
        return self._flat(X, order, batches, rule, lambda b: X[b] - m, parallel=True)

    def _balance_sign(self, X, order, batches, m, rule):
        return self._flat(X, order, batches, rule, lambda b: torch.sign(X[b] - m))

    def _balance_adamean(self, X, order, batches, m, rule):
        v = 1.0 if self.v_scale is None else self.v_scale
        return self._flat(X, order, batches, rule, lambda b: (X[b] - m) / v)

    def _ema_z(self, b, X):
        self.ema_t += 1
        self.ema_m, centre = self._update_ema(self.ema_m, X[b].mean(0), self.rate, self.ema_t)
        return X[b] - centre

    def _balance_ema(self, X, order, batches, m, rule):
        return self._flat(X, order, batches, rule, lambda b: self._ema_z(b, X))

    def _adaema_z(self, b, X):
        self.ema_t += 1
        mean = X[b].mean(0)
        self.ema_m, mc = self._update_ema(self.ema_m, mean, 0.1, self.ema_t)
        self.ema_v, vc = self._update_ema(self.ema_v, mean * mean, 0.001, self.ema_t)
        return (X[b] - mc) / (vc.sqrt() + 1e-8)

    def _balance_adaema(self, X, order, batches, m, rule):
        return self._flat(X, order, batches, rule, lambda b: self._adaema_z(b, X))

    def _balance_pair(self, X, order, batches, m, rule):
        s = torch.zeros(X.shape[1], dtype=X.dtype)
        front, back = [], []
        waiting: list[int] = []
        for b in batches:
            items = waiting + b
            rule.draw(len(items) // 2)
            for j in range(len(items) // 2):
                a, c = items[2 * j], items[2 * j + 1]
                z = X[a] - X[c]
                eps = rule.sign(s, z)
                s = s + eps * z
                plus, minus = (a, c) if eps > 0 else (c, a)
                front.append(plus)
                back.append(minus)
            waiting = [items[-1]] if len(items) % 2 else []
        return front_back(order, front, back)

    def _balance_recursive(self, X, order, batches, m, rule):
        D = self.depth
        sums = [torch.zeros(X.shape[1], dtype=X.dtype) for _ in range(2 ** (D + 1) - 1)]
        leaf_front: dict[int, list[int]] = {}
        leaf_back: dict[int, list[int]] = {}
        for b in batches:
            rule.draw(len(b) * (D + 1))
            for i in b:
                z = X[i] - m
                node = 0
                for level in range(D + 1):
                    eps = rule.sign(sums[node], z)
                    sums[node] = sums[node] + eps * z
                    if level < D:
                        node = 2 * node + 1 if eps > 0 else 2 * node + 2
                (leaf_front if eps > 0 else leaf_back).setdefault(node, []).append(i)
        first = 2**D - 1
        left, right = [], []
        for leaf in range(first, 2 ** (D + 1) - 1):
            half = left if leaf - first < 2 ** max(D - 1, 0) else right
            half += leaf_front.get(leaf, []) + leaf_back.get(leaf, [])[::-1]
        placed = set(left) | set(right)
        return left + [i for i in order if i not in placed] + right

    def _balance_recursive_pair(self, X, order, batches, m, rule):
        sums: dict[int, torch.Tensor] = {}
        per_batch = []

        def solve(group, node):
            if len(group) < 2:
                return group
            s = sums.setdefault(node, torch.zeros(X.shape[1], dtype=X.dtype))
            left, right = [], []
            for t in range(len(group) // 2):
                a, c = group[2 * t], group[2 * t + 1]
                rule.draw(1)
                eps = rule.sign(s, X[a] - X[c])
                s = s + eps * (X[a] - X[c])
                left.append(a if eps > 0 else c)
                right.append(c if eps > 0 else a)
            sums[node] = s
            if len(group) % 2:
                left.append(group[-1])
            return solve(left, 2 * node + 1) + solve(right, 2 * node + 2)

        for b in batches:
            per_batch.append(solve(list(b), 0))
        read = []
        for slot in range(max((len(b) for b in per_batch), default=0)):
            seq = per_batch if slot % 2 == 0 else per_batch[::-1]
            read += [b[slot] for b in seq if len(b) > slot]
        placed = set(read)
        middle = [i for i in order if i not in placed]
        return read[: len(read) // 2] + middle + read[len(read) // 2 :]


def prefix_herding(X: torch.Tensor, order: list[int]) -> float:
    """max_k ||sum_{t<=k} (x_order[t] - mean)||_inf, written out."""
    Z = (X - X.mean(0))[order]
    return float(Z.cumsum(0).abs().max())
