"""PLD- against RDP-calibrated σ on the same round-three cells: test accuracy paired by seed.

    python benchmarks/utility/compare_accountants.py RDP.json PLD.json [RDP.json PLD.json ...]

Each pair is one cell (task, optimizer, ε) run twice with the same seeds, methods and tuning
grid, once with ``--accountant rdp`` and once with ``--accountant pld``. Prints, per method,
σ under each, the test accuracy of each (mean ± SE over seeds) and the paired difference
PLD − RDP (mean ± SE of the per-seed differences). A method's configuration is the one each
run picked on validation (so the picks may differ between the two).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_round3 import paired  # noqa: E402


def _mean_se(final: dict) -> tuple[float, float]:
    """Test accuracy (%) of a method over its seeds, and its standard error."""
    values = [100 * run["metric"] for run in final["runs"]]
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def _cell(path: Path) -> tuple[dict, dict]:
    data = json.loads(path.read_text())
    (eps, cell), = data["cells"].items()
    return data, cell


def main(argv: list[str]) -> None:
    if len(argv) < 2 or len(argv) % 2:
        raise SystemExit(__doc__)
    for rdp_path, pld_path in zip(argv[::2], argv[1::2]):
        rdp, rdp_cell = _cell(Path(rdp_path))
        pld, pld_cell = _cell(Path(pld_path))
        print(f"\n**{pld['task']} | {pld['optimizer_name']} at ε = {pld_cell['epsilon']:g}** "
              f"({len(pld['seeds'])} seeds; `{Path(rdp_path).name}` against `{Path(pld_path).name}`)\n")
        print("| method | σ RDP | σ PLD | test acc. % RDP | test acc. % PLD | PLD − RDP (paired) |")
        print("|---|---|---|---|---|---|")
        for method, p in pld_cell["final"].items():
            r = rdp_cell["final"].get(method)
            if r is None:
                continue
            (rm, rs), (pm, ps) = _mean_se(r), _mean_se(p)
            dm, ds = paired(p, r)  # the round-three report's pairing by seed
            print(f"| {method} | {r['sigma']:.3f} | {p['sigma']:.3f} | {rm:.1f} ± {rs:.1f} | {pm:.1f} ± {ps:.1f} | "
                  f"{dm:+.2f} ± {ds:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
