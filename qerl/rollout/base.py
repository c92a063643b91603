"""The rollout-engine interface shared by the embedded HF engine and vLLM.

An engine is deliberately NOT an ``nn.Module`` attribute of the LightningModule: Lightning must
never move it between devices or put it into a checkpoint. The ``RolloutCallback`` owns it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from qerl.losses import groups_with_signal
from qerl.settings_checks import require_numbers


# The smallest sampling temperature taken: below it the tempered distribution is greedy's to any
# precision, and logits / T heads for fp32 overflow (1e-40 made every logit inf).
MIN_TEMPERATURE = 1e-3


class NonFiniteLogits(RuntimeError):
    """An engine met NaN / inf logits while generating: the weights, the AQN noise or the sampling
    settings make the policy non-finite. ``train.py`` prints it as one line."""


@dataclass
class SamplingSettings:
    """How completions are sampled.

    Args:
        temperature: softmax temperature (QeRL: 1.0 for training rollouts). 0 means greedy.
        top_p: nucleus sampling mass (1.0 = off).
        top_k: keep only the k most likely tokens (0 = off).
        max_new_tokens: completion length cap; a completion that hits it finishes with "length".
        min_p: drop tokens less likely than ``min_p`` x the most likely token (0 = off); applied
            before top-k / top-p, on the tempered distribution, as vLLM does.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_p: float = 0.0

    def __post_init__(self) -> None:  # a bad YAML value fails at start, naming its key
        require_numbers(self, "sampling")
        check_temperature_top_p(self.temperature, self.top_p, "sampling")
        if not self.top_k >= 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0: off), got {self.top_k}")
        if not self.max_new_tokens >= 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling.min_p must be in [0, 1] (0: off), got {self.min_p}")


def check_temperature_top_p(temperature: float, top_p: float, section: str) -> None:
    """Refuse a temperature or top-p no sampler can use, naming ``section``'s key. Written so that
    NaN fails (``nan < 0`` is false: a NaN temperature reached torch.multinomial at the first
    rollout); an infinite temperature is refused too."""
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"{section}.temperature must be >= 0 and finite (0: greedy), got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:  # logits / 1e-40 overflow fp32: non-finite logits
        raise ValueError(f"{section}.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{section}.top_p must be in (0, 1] (1: off), got {top_p}")


@dataclass
class Generation:
    """What an engine returns for ``len(prompt_ids) * n`` samples, prompt-major (prompt 0's n
    samples first, then prompt 1's ...).

    ``sampler_logprobs[i][t]`` is the log-probability of the sampled token under the distribution
    it was drawn from: log softmax(logits / temperature) of the engine's own forward, restricted to
    the min-p / top-k / top-p set and renormalised over it (with top_p = 1, top_k = 0, QeRL's setting, the
    trainer's own log softmax(logits / T)); log softmax(logits) when greedy. exp(trainer log-prob -
    sampler log-prob) is the truncated-IS weight, so a top-k/top-p rollout is corrected like any
    other mismatch between sampler and trainer.
    """

    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (EOS emitted) or "length" (hit max_new_tokens)
    timings: dict[str, float] = field(default_factory=dict)


class RolloutEngine:
    """Interface. ``sync`` pushes the current policy (LoRA weights and, with AQN, the noisy norm
    scales) into the engine; ``adapter=False`` makes the following ``generate`` calls run the base
    model alone (evaluation's "before" row). ``generate`` samples; ``sleep``/``wake`` free and restore
    its memory. ``last_sync`` holds the seconds of the last ``sync``'s parts (``time/sync/<part>``)."""

    last_sync: dict[str, float] = {}  # an engine assigns its own dict; never mutated in place

    def sync(self, model: torch.nn.Module, norm_scales: dict[str, torch.Tensor] | None = None,
             adapter: bool = True) -> None:
        raise NotImplementedError

    def generate(
        self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings, seed: int | Sequence[int]
    ) -> Generation:
        """``n`` samples of each prompt. ``seed``: an int seeds the call (prompt i draws from
        ``derive_seed(seed, i)``); a list gives every prompt its own seed, so its samples do not depend
        on which other prompts share the call (evaluation: the same samples at any batch or world size).
        Give hashed seeds (``derive_seed``): vLLM draws sample j of a prompt seeded s from s + j, so
        consecutive seeds would share streams across prompts."""
        raise NotImplementedError

    def sleep(self) -> None:  # optional
        pass

    @contextlib.contextmanager
    def awake(self):
        """Stay awake across the ``generate`` calls inside (an evaluation's batches); sleep after."""
        yield

    def wake(self) -> None:  # optional
        pass


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2**62) from any parts, by a stable hash: (seed, prompt index), (seed, dataset,
    problem) ... give independent streams. Below 2**62 so that vLLM can add the sample index."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def prompt_seeds(seed: int | Sequence[int], prompts: int) -> list[int]:
    """One seed per prompt of a ``generate`` call (see ``RolloutEngine.generate``)."""
    if isinstance(seed, Sequence):
        if len(seed) != prompts:
            raise ValueError(f"{len(seed)} prompt seeds for {prompts} prompts")
        return [int(s) for s in seed]
    return [derive_seed(int(seed), i) for i in range(prompts)]


def sample_uniforms(prompt_seed: int, sample: int, steps: int) -> torch.Tensor:
    """``(steps,)`` float64 uniforms in [0, 1) that draw the tokens of sample ``sample`` of a prompt
    seeded ``prompt_seed``: one per generated token, from a generator seeded by the pair, so a
    completion's draws are its own whatever else is decoded beside it. NumPy's PCG64 takes the whole
    62-bit seed (torch's CPU generator keeps 32 bits: two of 150k rows drew the same stream)."""
    return torch.from_numpy(np.random.default_rng(derive_seed(prompt_seed, sample)).random(steps))


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids ``(B,)`` drawn from ``probs`` ``(B, V)`` (rows need not be normalised) by inverse
    transform sampling with one uniform in [0, 1) per row: the first token whose cumulative mass exceeds
    ``u * total``. A zero-probability token is never chosen (its cumulative mass equals its
    predecessor's); the cumulative sum is in float64, so rounding moves no token's mass noticeably."""
    cdf = probs.double().cumsum(-1)  # (B, V)
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # (B, 1), in [0, total)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def stop_token_ids(tokenizer, model: torch.nn.Module | None = None) -> list[int]:
    """Tokens that end a completion: the tokenizer's EOS, the model's ``generation_config`` EOS ids
    (Qwen instruct models list both ``<|im_end|>`` and ``<|endoftext|>``) and the chat template's
    end-of-turn token (a base model such as Qwen2.5-7B has a ChatML template but EOS
    ``<|endoftext|>`` only: without it every completion ran on past its turn to max_new_tokens)."""
    stop = [tokenizer.eos_token_id, end_of_turn_token(tokenizer)]
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop += extra if isinstance(extra, list) else ([extra] if extra is not None else [])
    return sorted({t for t in stop if t is not None})


def end_of_turn_token(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``), read off a rendered two-turn chat; None without a template,
    when rendering fails, or when what follows the turn is plain text (a newline, a role name)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "Qz7 qerl turn end"  # text no template adds to, followed by whatever closes the turn
    try:
        chat = [{"role": "user", "content": "1 + 1"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        if not isinstance(text, str) or marker not in text:
            return None
        ids = tokenizer(text[text.rindex(marker) + len(marker):], add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - a template that needs other roles or variables: EOS ids only
        return None
    if not ids:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = ids[0] in set(tokenizer.all_special_ids) or getattr(added.get(ids[0]), "special", False)
    return int(ids[0]) if special else None


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: returns ids and mask, both ``(B, max_len)``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def pad_right(seqs: list[list], pad_value, dtype=torch.long, min_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad lists (token ids or log-probs): returns values and mask, both ``(B, max_len)``."""
    width = max([min_width] + [len(s) for s in seqs])
    out = torch.full((len(seqs), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.tensor(s, dtype=dtype)
            mask[i, : len(s)] = 1
    return out, mask


@dataclass
class Rollout:
    """A scored rollout batch, attached to the training batch by the ``RolloutCallback``.

    N = prompts * group_size rows, prompt-major. P = padded prompt length, T = padded completion length.
    """

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T)
    sampler_logprobs: torch.Tensor  # (N, T) float32, 0 on padding
    rewards: torch.Tensor  # (N,) float32
    reward_components: dict[str, torch.Tensor]  # name -> (N,)
    truncated: torch.Tensor  # (N,) bool: hit max_new_tokens without a stop token
    group_size: int
    temperature: float
    max_new_tokens: int
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # (N,) the training source each prompt came from
    timings: dict[str, float] = field(default_factory=dict)
    # DAPO dynamic sampling: groups generated but not trained on -- zero-signal ones (0 when all were:
    # they train) and mixed ones beyond the batch (a refill's surplus, a DDP rank's surplus)
    num_groups_dropped: int = 0
    # mean task reward (the reward functions' sum, without DAPO's overlong shaping) of every group
    # generated this step, before dynamic sampling kept the mixed ones: what the policy earns (the
    # kept groups' mean stays near 0.5 while accuracy climbs); None: the mean of ``rewards``
    sampled_reward: float | None = None
    # every generated completion's length and truncation flag, (M,), before dynamic sampling: a group
    # whose completions all hit max_new_tokens scores all-equal and is dropped first, so the kept
    # rows alone would hide the truncation the clipped ratio and its warning are there to show;
    # None: these rows are all that was generated
    all_lengths: torch.Tensor | None = None
    all_truncated: torch.Tensor | None = None
    # the share of every generated group whose task rewards were all equal (no overlong shaping: a
    # length penalty alone separates completions without any signal from the task); what the
    # "no learning signal" warning watches. None: that of ``rewards``
    sampled_frac_zero_std: float | None = None

    def mean_sampled_reward(self) -> float:
        """``sampled_reward``, or the mean of ``rewards`` when nothing was filtered out."""
        return float(self.rewards.float().mean()) if self.sampled_reward is None else self.sampled_reward

    def sampled_lengths(self) -> torch.Tensor:
        """Every generated completion's length in tokens (``all_lengths``, or these rows')."""
        return self.completion_mask.sum(-1) if self.all_lengths is None else self.all_lengths

    def frac_task_zero_std(self) -> float:
        """``sampled_frac_zero_std``, or the share of these rows' groups with all-equal rewards."""
        if self.sampled_frac_zero_std is not None:
            return self.sampled_frac_zero_std
        return float(1.0 - groups_with_signal(self.rewards, self.group_size).float().mean())

    def sampled_truncated(self) -> torch.Tensor:
        """Every generated completion's truncation flag (``all_truncated``, or these rows')."""
        return self.truncated if self.all_truncated is None else self.all_truncated

    def to(self, device: torch.device | str) -> "Rollout":
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logprobs", "rewards", "truncated"):
            setattr(self, name, getattr(self, name).to(device))
        self.reward_components = {k: v.to(device) for k, v in self.reward_components.items()}
        return self
