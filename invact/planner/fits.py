"""The search for what fits: `largest(peak, budget, step, cap)`, the largest sequence (or batch) whose
step's peak fits in a budget, from four or five planned peaks."""

from __future__ import annotations

# The longest sequence searched where the config gives no max_position_embeddings: 2^20 tokens.
SEQ_CAP = 2**20
# The largest batch searched.
BATCH_CAP = 2**14


def largest(peak, budget: int, step: int, cap: int) -> tuple[int, dict, int]:
    """(the largest multiple x of `step` in [step, cap] with peak(x)["peak_bytes"] <= budget, 0 where
    not even `step` fits; peak(x) there, or peak(step) where nothing fits; how many peaks it computed).
    peak must not decrease as x grows. Each guess is the secant through the two nearest points known,
    rounded down to a multiple of `step` and kept inside the bracket, through peak(x)'s
    "activation_peak_bytes" where it has them (forward's and backward's peak, close to affine in the
    sequence and the batch; the optimizer step's, which does not grow, can make the whole peak flat):
    four or five peaks answer."""
    known: dict[int, dict] = {}

    def fits(x: int) -> bool:
        if x not in known:
            known[x] = peak(x)
        return known[x]["peak_bytes"] <= budget

    def bytes_at(x: int) -> int:  # what the secant follows: the part of the peak that grows with x
        fits(x)
        return known[x].get("activation_peak_bytes", known[x]["peak_bytes"])

    def down(value: float) -> int:
        return int(value) // step * step

    cap = max(step, down(cap))
    # Two probes first, 16 and 32 steps (most answers lie beyond them, and a secant through the smallest
    # sizes extrapolates from fixed costs); the smallest size only where the first does not fit.
    first = min(cap, 16 * step)
    if not fits(first):
        if first == step or not fits(step):
            return 0, known[step], len(known)
        low, high = step, first
    else:
        low, high = first, None
        x = min(cap, 2 * first)
    while high is None:  # grow: extrapolate through the last two points that fit
        if x <= low:
            return low, known[low], len(known)
        if not fits(x):
            high = x
            break
        before, low = low, x
        if low >= cap:
            return low, known[low], len(known)
        slope = (bytes_at(low) - bytes_at(before)) / (low - before)
        guess = low + (budget - bytes_at(low)) / slope if slope > 0 else 2 * low
        # at most 8 times as far: a peak still flat there (the gradients' end of backward) has no slope
        x = min(cap, 8 * low, max(low + step, down(guess)))
    moved = None  # the end the last guess moved; where a secant moves the same end twice, it bisects
    while high - low > step:  # narrow: the secant through the bracket's ends
        rise = bytes_at(high) - bytes_at(low)
        if rise > 0 and moved != "twice":
            guess = low + (budget - bytes_at(low)) * (high - low) / rise
        else:
            guess = (low + high) / 2
        x = min(high - step, max(low + step, down(guess)))
        side = "low" if fits(x) else "high"
        low, high = (x, high) if side == "low" else (low, x)
        moved = "twice" if side == moved else side
    return low, known[low], len(known)
