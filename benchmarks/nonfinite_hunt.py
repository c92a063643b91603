"""Where does a non-finite loss or gradient come from? ``train.py`` with every module of the policy watched.

    python benchmarks/nonfinite_hunt.py --out hunt.json -- \\
        fit --config benchmarks/official_prompt_testbed.yaml --seed_everything 1

During each training step (not during the rollout: the engine's CUDA graphs cannot hold the checks)
every module's output is checked for NaN / inf -- the no-grad passes, the update's forward and the
checkpoint recompute -- every output's gradient as the backward reaches it, and the trainable
gradients after each micro-batch's backward. One line per finding on stdout (``HUNT ...``), all of
them in ``--out``'s JSON. The first module whose *output gradient* is non-finite while its forward
was finite is where the backward broke: that is how the H200's cuDNN attention was found
(results/nonfinite_hunt_h200.json, qerl/attention_masks.py). Each check synchronises the GPU: slow,
for debugging only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Hunt:
    """Installs the checks around ``QeRLModule._rl_step``; ``findings`` collects what they saw."""

    def __init__(self, max_findings: int = 200):
        self.max_findings = max_findings
        self.findings: list[dict] = []
        self._phase, self._mask, self._padding, self._first_grad = "", None, None, None

    def report(self, **finding) -> None:
        if len(self.findings) < self.max_findings:
            self.findings.append(finding)
            print("HUNT", " ".join(f"{k}={v}" for k, v in finding.items()), flush=True)

    def _forward_hook(self, name: str):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            if not torch.is_tensor(out) or not out.is_floating_point():
                return None
            finite = torch.isfinite(out)
            if not bool(finite.all()):
                rows = None  # non-finite rows at real tokens / at padding, when the shape says which is which
                mask = self._mask if self._mask is not None and self._mask.dim() == 2 else self._padding
                if mask is not None and out.dim() == 3 and out.shape[:2] == mask.shape:
                    bad = ~finite.all(-1)
                    rows = [int((bad & mask.bool()).sum()), int((bad & ~mask.bool()).sum())]
                self.report(kind="forward", phase=self._phase, module=name, shape=list(out.shape),
                            non_finite=int((~finite).sum()), real_and_padding_rows=rows)
            if out.requires_grad:
                out.register_hook(self._gradient_hook(name))
            return None
        return hook

    def _gradient_hook(self, name: str):
        def hook(grad):
            if self._first_grad is None and not bool(torch.isfinite(grad).all()):
                self._first_grad = name
                self.report(kind="first_output_gradient", phase=self._phase, module=name, shape=list(grad.shape),
                            non_finite=int((~torch.isfinite(grad)).sum()))
            return None
        return hook

    def _root_pre_hook(self, module, args, kwargs):
        self._mask = kwargs.get("attention_mask")
        return None

    def install(self, module_class=None):
        """Wrap ``module_class._rl_step`` (default: ``QeRLModule``'s) with the checks, and the trainer's
        mask builder (process-wide) to see the 2-D padding mask; returns the function that undoes both."""
        import lightning_modules.policy_forward as policy_forward
        import lightning_modules.qerl_module as qerl_module

        if module_class is None:
            module_class = qerl_module.QeRLModule
        step, hunt = module_class._rl_step, self
        explicit_mask = policy_forward.left_padding_mask

        def recorded_mask(model, attention_mask):  # the 2-D mask behind the trainer's 4-D one
            hunt._padding = attention_mask
            return explicit_mask(model, attention_mask)

        policy_forward.left_padding_mask = recorded_mask

        def watched_step(module, batch):
            handles = [module.model.register_forward_pre_hook(hunt._root_pre_hook, with_kwargs=True)]
            handles += [m.register_forward_hook(hunt._forward_hook(n)) for n, m in module.model.named_modules() if n]
            backward, count = module.manual_backward, [0]

            def watched_backward(loss, *args, **kwargs):
                hunt._first_grad, hunt._phase = None, f"step {module.global_step} backward {count[0]}"
                backward(loss, *args, **kwargs)
                bad = [n for n, p in module.model.named_parameters()
                       if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
                if bad:
                    hunt.report(kind="parameter_gradients", phase=hunt._phase, loss=float(loss), non_finite=len(bad),
                                first=bad[0])
                count[0] += 1
                hunt._phase = f"step {module.global_step} forward"

            module.manual_backward = watched_backward
            hunt._phase = f"step {module.global_step} forward"
            try:
                return step(module, batch)
            finally:
                for h in handles:
                    h.remove()
                del module.manual_backward

        module_class._rl_step = watched_step

        def uninstall():
            module_class._rl_step = step
            policy_forward.left_padding_mask = explicit_mask

        return uninstall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="the findings as JSON")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments (fit --config ...)")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    hunt = Hunt()
    hunt.install()
    from train import main as train_main

    try:
        train_main(train_args)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": " ".join(sys.argv), "findings": hunt.findings}, f, indent=1)
    print(f"HUNT done: {len(hunt.findings)} findings", flush=True)


if __name__ == "__main__":
    main()
