#!/usr/bin/env python3
"""Tests of scripts/check_docs.py (`make check-docs` runs them): on a copy of this
repository's Makefile, clap sources and Cargo manifests, a doc that names only what
exists passes, and each kind of broken name is reported with its line."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import check_docs  # noqa: E402  (after the path is set)

# What the checker reads of the repository.
COPIED = ["Makefile", "Cargo.toml", "launcher/Cargo.toml", "src/main.rs",
          "launcher/src/args.rs", "launcher/slurm/vrtspike.sbatch",
          "configs/demo/unet_spike_demo.yaml"]

GOOD = """\
# Title

## A section: with `code`

```
make demo
make build NCCL=0 && make gpu-bundle [VRT_REF=<a checkout>]
vrtspike cache serve --address NAME (--cap 20G | --config run.yaml) [--allow-uid UID]
target/release/vrtspike train --config C --set=TRAIN.LR=1e-4
vrtspike-launch --gpus 0 --ranks 2 --config configs/demo/unet_spike_demo.yaml -- --stop-after-steps 5
torchrun --standalone --nproc-per-node 4 --no-python vrtspike train --config C --device cuda
vrtspike config show --config C | head
cargo test --test cache_stress
```

See [the other doc](other.md#second-heading), [here](#a-section-with-code),
[a folder](../launcher/slurm/), `launcher/slurm/vrtspike.sbatch`, `src/cli/*.rs`,
`logs/rank<R>.log`, `vrtspike h5-probe`, `vrtspike cache`, `vrtspike-launch --rank-cmd`,
``a quoted message: `.../vrtspike not found beside .../vrtspike-launch (build it)` ``,
`docs: every link, path, make target and command exists`, [web](https://example.com/x).
"""

OTHER = """\
# Other

## Second heading

## Second heading
"""


class CheckDocsTest(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="check-docs-")
        for rel in COPIED:
            os.makedirs(os.path.dirname(os.path.join(self.root, rel)) or self.root, exist_ok=True)
            shutil.copy(os.path.join(ROOT, rel), os.path.join(self.root, rel))
        for cli in ("src/cli", "crates/data/src/cli"):
            shutil.copytree(os.path.join(ROOT, cli), os.path.join(self.root, cli))
        os.makedirs(os.path.join(self.root, "tests"))
        open(os.path.join(self.root, "tests/cache_stress.rs"), "w").close()
        os.makedirs(os.path.join(self.root, "docs"))
        self.write("docs/other.md", OTHER)
        self.write("README.md", "# Readme\n\n[Guide](docs/guide.md)\n")

    def tearDown(self) -> None:
        shutil.rmtree(self.root)

    def write(self, rel: str, text: str) -> None:
        with open(os.path.join(self.root, rel), "w", encoding="utf-8") as f:
            f.write(text)

    def problems_with(self, extra: str) -> list[str]:
        """The problems of docs/guide.md = GOOD + `extra`."""
        self.write("docs/guide.md", GOOD + extra)
        problems, _ = check_docs.check(self.root)
        return [str(p) for p in problems]

    def assert_one(self, extra: str, *fragments: str, line_in_extra: int = 1) -> None:
        problems = self.problems_with(extra)
        self.assertEqual(len(problems), 1, problems)
        line = len(GOOD.splitlines()) + line_in_extra
        self.assertTrue(problems[0].startswith(f"docs/guide.md:{line}: "), problems)
        for fragment in fragments:
            self.assertIn(fragment, problems[0])

    def test_what_exists_passes(self) -> None:
        self.assertEqual(self.problems_with(""), [])

    def test_a_link_to_a_missing_file(self) -> None:
        self.assert_one("[gone](nowhere.md)\n", "'nowhere.md'", "no such file")

    def test_a_link_to_a_missing_anchor(self) -> None:
        self.assert_one("[gone](other.md#third-heading)\n", "#third-heading", "docs/other.md")

    def test_a_duplicate_heading_has_a_numbered_anchor(self) -> None:
        self.assertEqual(self.problems_with("[2nd](other.md#second-heading-1)\n"), [])
        self.assert_one("[3rd](other.md#second-heading-2)\n", "#second-heading-2")

    def test_a_missing_anchor_in_the_same_file(self) -> None:
        self.assert_one("[x](#not-here)\n", "#not-here")

    def test_a_link_out_of_the_repository(self) -> None:
        self.assert_one("[x](../../elsewhere.md)\n", "leaves the repository")

    def test_a_missing_repository_path(self) -> None:
        self.assert_one("`src/ddp/gone.rs`\n", "src/ddp/gone.rs")

    def test_a_glob_that_matches_nothing(self) -> None:
        self.assert_one("`launcher/tests/launch_*.rs`\n", "launch_*.rs")

    def test_a_missing_make_target(self) -> None:
        self.assert_one("`make tset`\n", "make tset")

    def test_a_missing_make_target_after_a_shell_operator(self) -> None:
        self.assert_one("```\ncd x && make demo bench-nothing\n```\n", "make bench-nothing", line_in_extra=2)

    def test_a_missing_subcommand(self) -> None:
        self.assert_one("`vrtspike trian --config C`\n", "vrtspike trian", "no such subcommand")

    def test_a_missing_nested_subcommand(self) -> None:
        self.assert_one("`vrtspike cache serv`\n", "vrtspike cache serv")

    def test_a_flag_of_another_subcommand(self) -> None:
        # --watch is `cache stats`'s, not `cache serve`'s.
        self.assert_one("`vrtspike cache serve --watch 2`\n", "vrtspike cache serve --watch")

    def test_a_missing_launcher_flag(self) -> None:
        self.assert_one("`vrtspike-launch --gpu 2 --config C`\n", "vrtspike-launch --gpu")

    def test_train_flags_after_the_launchers_double_dash(self) -> None:
        self.assert_one("`vrtspike-launch --config C -- --steps 5`\n", "vrtspike train", "--steps")

    def test_a_continued_line_is_one_command(self) -> None:
        self.assert_one("```\nvrtspike plan --config C \\\n    --gpu-memory 48G\n```\n", "--gpu-memory", line_in_extra=2)

    def test_a_package_name_is_not_a_command(self) -> None:
        extra = "`cargo test -p vrtspike-launch --test cache_stress -- --ignored`\n"
        self.assertEqual(self.problems_with(extra), [])
        self.assert_one("`cargo test -p vrtspike-launch --test cache_strss`\n", "cache_strss")

    def test_a_missing_test_target(self) -> None:
        self.assert_one("`cargo test --test cache_strss`\n", "cache_strss")

    def test_the_command_line_fails_on_a_broken_link(self) -> None:
        self.write("docs/guide.md", GOOD + "[gone](nowhere.md)\n")
        argv = sys.argv
        sys.argv = ["check_docs.py", "--root", self.root]
        try:
            self.assertEqual(check_docs.main(), 1)
        finally:
            sys.argv = argv


class RealSourcesTest(unittest.TestCase):
    """The static reading of the clap sources finds what the binaries have."""

    def test_subcommands_and_flags(self) -> None:
        vrtspike, launcher = check_docs.load_binaries(ROOT)
        self.assertIn("h5-probe", vrtspike.subcommands)
        serve = vrtspike.subcommands["cache"].subcommands["serve"]
        self.assertTrue({"--cap", "--address", "--allow-uid", "--exit-with-parent"} <= serve.flags)
        self.assertIn("--options", vrtspike.subcommands["bench"].subcommands["cache-worker"].flags)
        self.assertIn("--gpu-mem", vrtspike.subcommands["plan"].flags)
        self.assertTrue({"--config", "--gpus", "--set", "--no-plan-check"} <= launcher.flags)

    def test_make_targets(self) -> None:
        targets = check_docs.make_targets(ROOT)
        self.assertTrue({"demo", "test", "check-docs", "gpu-bundle-check"} <= targets)


if __name__ == "__main__":
    unittest.main(verbosity=1)
