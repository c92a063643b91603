"""Is there an NVFP4 storage layout whose decode costs one shift and one AND per bf16x2? (CPU only.)

    python benchmarks/decode_layout_search.py [--out benchmarks/results/decode_layout_search.json]

The kernels decode e2m1 codes by moving each code's sign to bf16 bit 15 and its 3 magnitude bits to
bits 8..6 (exponent low bits + mantissa top bit; the value comes out x 2^-126, folded into the block
scale), two codes per 32-bit register: output bit set ``M = {6, 7, 8, 15, 22, 23, 24, 31}``. A layout
(any order of the 32 bits of 8 codes, also across several words) would decode a register in one
shift (or rotate, or funnel shift of two words) plus one AND exactly when shifted windows of ``M``
partition the words' bits. This script searches for such a partition by exact cover over W = 1..3
words: logical shifts, rotations, and funnel shifts of any ordered pair of words. It finds none, so
every layout needs at least a second masking op per register (sign and magnitude come from
different shifts); see kernels/NOTES.md for what that leaves to gain from a format change.
"""

import argparse
import json

M = (6, 7, 8, 15, 22, 23, 24, 31)


def funnel_windows(words: int, pattern=M) -> list[tuple[tuple, frozenset]]:
    """Every (hi word, lo word, shift) window of ``pattern``: bit j of ``(hi:lo) >> s`` is bit j + s of
    the pair. hi == lo is a rotation; a zero-filled logical shift is the same set as a funnel window."""
    out = []
    for hi in range(words):
        for lo in range(words):
            for s in range(64):
                pos = [j + s for j in pattern]
                if max(pos) >= 64:
                    continue
                bits = frozenset(lo * 32 + p if p < 32 else hi * 32 + p - 32 for p in pos)
                if len(bits) == len(pattern):
                    out.append(((hi, lo, s), bits))
    return out


def exact_cover(n_bits: int, options: list) -> list | None:
    """One choice of options whose bit sets partition range(n_bits), or None (depth-first, first free bit)."""
    by_bit: dict[int, list] = {}
    for opt in options:
        for b in opt[1]:
            by_bit.setdefault(b, []).append(opt)

    def rec(covered: frozenset, chosen: list):
        if len(covered) == n_bits:
            return chosen
        first = next(b for b in range(n_bits) if b not in covered)
        for name, bits in by_bit.get(first, []):
            if not bits & covered:
                found = rec(covered | bits, chosen + [name])
                if found is not None:
                    return found
        return None

    return rec(frozenset(), [])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--max-words", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for words in range(1, args.max_words + 1):
        options = funnel_windows(words)
        found = exact_cover(32 * words, options)
        rows.append({"words": words, "windows": len(options), "partition": found})
        print(f"{words} word(s): {len(options)} shifted windows of M, partition: {found}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"output_bits": M, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
