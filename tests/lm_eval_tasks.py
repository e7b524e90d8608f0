"""lm-evaluation-harness's local task of multiple choice over a JSON-lines file, for the tests that run lm-eval
against the server (tests/trainer/test_serve_evaluate.py) and through a deployed endpoint (tests/control)."""

# Formatted with the task's name and its data file; the doubled braces leave lm-eval's own `{{field}}`.
MULTIPLE_CHOICE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
