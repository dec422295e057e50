"""Local lm-evaluation-harness tasks: a YAML file per task over a jsonl file, for the suite's harness tests and
the KV-format benchmark (no dataset hub is needed)."""

from __future__ import annotations

from pathlib import Path

HEAD = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"

# Rolling perplexity over each row's "text" (loglikelihood_rolling).
ROLLING = ('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
           "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")


def multiple_choice(text_field: str, target_delimiter: str | None = None) -> str:
    """Multiple choice over the row's `text_field`, "choices" and "answer" (an index), scored acc / acc_norm.
    `target_delimiter`: what joins context and choice (lm-eval's default, a space, when None)."""
    delimiter = "" if target_delimiter is None else f'target_delimiter: "{target_delimiter}"\n'
    return (f'output_type: multiple_choice\ndoc_to_text: "{{{{{text_field}}}}}"\ndoc_to_choice: "{{{{choices}}}}"\n'
            f'{delimiter}doc_to_target: "{{{{answer}}}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')


def write_task(d: Path, task: str, data: Path, spec: str) -> None:
    """d/<task>.yaml: the task named `task` over the jsonl file `data`, as `spec` describes it."""
    (d / f"{task}.yaml").write_text(f"task: {task}\n" + HEAD.format(path=data) + spec)
