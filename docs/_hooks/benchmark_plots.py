"""mkdocs hook: publish the committed plots of benchmarks/results/ under results/plots/.

The PNGs stay where benchmarks/training.py writes them (one copy in the repository); the results
pages link to results/plots/NAME.png and the build copies each file from benchmarks/results/.
"""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/plots/{png.name}", abs_src_path=str(png)))
    return files
