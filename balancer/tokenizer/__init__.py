"""Prompts → token ids as the engine computes them: :mod:`~balancer.tokenizer.tokenizer` (the
tokenizers), :mod:`~balancer.tokenizer.chat_template` (chat rendering), :mod:`~balancer.tokenizer.segments`
(the segment cache), :mod:`~balancer.tokenizer.self_checks` (which shortcuts are exact for the
tokenizer loaded), :mod:`~balancer.tokenizer.default` (the embedded DeepSeek-V3 default) and
:mod:`~balancer.tokenizer.token_ids` (token-id prompts decoded from their JSON text, memoised)."""
