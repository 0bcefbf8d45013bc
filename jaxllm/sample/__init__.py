"""On-device sampling: logits processors, sampling, logprobs, inside the jitted step."""
