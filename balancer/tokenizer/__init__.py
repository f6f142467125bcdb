"""Prompts → token ids as the engine computes them: :mod:`~balancer.tokenizer.tokenizer` (the
tokenizers), :mod:`~balancer.tokenizer.chat_template` (chat rendering), :mod:`~balancer.tokenizer.segments`
(the segment cache) and :mod:`~balancer.tokenizer.default` (the embedded DeepSeek-V3 default)."""
