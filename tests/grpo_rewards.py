"""A reward for the GRPO tests: the share of a completion's characters that are vowels (varies between completions
of a random model, so the advantages and the gradient are not zero), as a user's own `file.py:function`."""


def vowel_share(prompts, completions, answers):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
