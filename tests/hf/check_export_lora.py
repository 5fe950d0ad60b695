"""kt-export against fix's LoRA fixtures: an independent reference for the export.

    check_export_lora.py KT_EXPORT WORKDIR FIXTURES_DIR

tests/hf/fixtures/<arch>_lora/lora_reference.safetensors holds per-expert LoRA adapters in
libkt's names and layout (KTransformers' split form) plus attention adapters, and the logits
transformers + PEFT computed with them (make_fixtures.py builds the PEFT model itself). This
writes a run file as kt_session_save would (the base fixture's weights plus those adapters),
exports it with kt-export --peft and --hf --merged, and compares through the fixtures' own
checkers (called in this process): check_peft.py (PeftModel.from_pretrained on the base) and check_hf.py
(from_pretrained of the merged checkpoint) against the fixture's logits. Exit 0 / 1, 77 when
torch / transformers / peft are missing or the fixtures are not there.
"""
import os
import shutil
import subprocess
import sys

try:
    import torch  # noqa: F401
    import peft  # noqa: F401
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"skipped: no PyTorch/PEFT ({e})")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_hf  # noqa: E402
import check_peft  # noqa: E402


def check(kt_export, work, fixtures, arch):
    lora = os.path.join(fixtures, arch + "_lora", "lora_reference.safetensors")
    base = os.path.join(fixtures, arch)
    with safe_open(lora, "pt") as f:
        meta = f.metadata()
    adapters = {k: v for k, v in load_file(lora).items()
                if ".lora_" in k and not k.startswith("grad.")}
    run = dict(load_file(os.path.join(base, "model.safetensors")))
    run.update(adapters)
    shutil.rmtree(os.path.join(work, arch), ignore_errors=True)
    os.makedirs(os.path.join(work, arch))
    run_path = os.path.join(work, arch, "run.safetensors")
    save_file(run, run_path)
    common = [kt_export, run_path, "--source", base, "--lora-alpha", meta["lora_alpha"],
              "--lora-rank", meta["lora_r"], "--model-type", meta["arch"]]
    ok = True
    for mode, out, checker, args in (
            ("--peft", "peft", check_peft, [base]),
            ("--hf", "merged", check_hf, [])):
        out_dir = os.path.join(work, arch, out)
        p = subprocess.run(common + [mode, out_dir] + (["--merged"] if mode == "--hf" else []),
                           capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{arch}: FAIL kt-export {mode}: rc {p.returncode}: {p.stderr.strip()}")
            ok = False
            continue
        print(f"{arch} {mode}: ", end="", flush=True)
        rc = checker.main(args + [out_dir, lora])  # prints its verdict
        if rc != 0:
            print(f"{arch} {mode}: FAIL {checker.__name__} exit {rc}")
            ok = False
    return ok


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    kt_export, work, fixtures = sys.argv[1:]
    archs = [a for a in ("mixtral", "qwen3_moe")
             if os.path.isfile(os.path.join(fixtures, a + "_lora", "lora_reference.safetensors"))]
    if not archs:
        print(f"skipped: no LoRA fixtures in {fixtures}")
        return 77
    os.makedirs(work, exist_ok=True)
    ok = all([check(kt_export, work, fixtures, a) for a in archs])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
