"""MkDocs hook: serve benchmarks/results/*.png as img/bench/*.png, so the benchmark page shows
the plots the benchmarks wrote without a second copy of them in docs/ (one source of truth)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config, **kwargs):
    root = Path(config["config_file_path"]).parent
    results = root / "benchmarks" / "results"
    for png in sorted(results.glob("*.png")):
        f = File(f"img/bench/{png.name}", src_dir=None, dest_dir=config["site_dir"],
                 use_directory_urls=config["use_directory_urls"])
        f.abs_src_path = str(png)
        files.append(f)
    return files
