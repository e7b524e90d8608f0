"""moe-tpu control plane: config, catalogue, rendering, cloud adapters, emulator, CLI."""
