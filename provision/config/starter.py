"""The starter config `moe-tpu init` writes (tests/control/goldens/moe-tpu.yaml.golden)."""

from __future__ import annotations


def starter_config() -> str:
    """The commented YAML that `moe-tpu init` writes."""
    return STARTER


STARTER = """\
# moe-tpu run config. Check it with `moe-tpu validate`; see every rendered request and
# script with `moe-tpu render --out rendered/`; rehearse without a cloud account with
# `moe-tpu --dry-run slice up`.

project: my-project            # Google Cloud project id
region: us-west4
zones: [us-west4-a]            # tried in order on stockout; each must offer TPU v5e
run: moe-demo                  # resource names and labels derive from it (lowercase, <= 50 chars)
target: tpu-vm                 # tpu-vm (queued resource) or vertex (Vertex AI custom job)

slice:
  accelerator: v5litepod-64    # 8x8: 16 VMs of 4 chips
  runtime_version: v2-alpha-tpuv5-lite
  count: 1                     # more than 1: multislice
  capacity: spot               # on-demand | spot | reserved (reserved needs `reservation:`)
  max_wait: 2h                 # give up queueing after this long (2h, 30m, 1h30m, 90s)
  network: default
  # subnetwork: my-subnet
  # service_account: trainer@my-project.iam.gserviceaccount.com

vertex:                        # used when target is vertex
  machine_type: ct5lp-hightpu-4t
  topology: 8x8
  scheduling: STANDARD         # STANDARD | SPOT | FLEX_START

image:
  repository: us-west4-docker.pkg.dev/my-project/moe/trainer
  tag: latest

trainer:
  config: v5e-64               # a named trainer config (this one is sized for v5litepod-64), or a path
  output_dir: gs://my-bucket/moe-demo
  mesh: data=8,expert=8        # the device mesh; `moe-tpu plan` suggests one (unset: all chips on data)
  # steps: 1000
  # overrides:                 # trainer config keys, passed as `--set key=value`
  #   moe.num_experts: 32

recovery:
  max_restarts: 3              # recreate the slice at most this often after preemption
"""
