"""Weight-sync helpers that RL frameworks import (upstream's ``sglang.srt.weight_sync``)."""
