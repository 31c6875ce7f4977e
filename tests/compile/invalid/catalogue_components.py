"""User code beside the catalogue's pipelines (found without PYTHONPATH): things that are not rewards,
filters or rankers, each named by one file of the invalid catalogue."""

THRESHOLD = 0.5  # not callable


def one_arg(completion):  # a reward takes (completion, answer)
    return 1.0


def needs_tokenizer(completion, answer, tokenizer):  # a third required argument the runtime never passes
    return 1.0


def trl_batch(prompts, completions, **kwargs):  # TRL's reward_funcs style: lists in, a list out; binds, scores nonsense
    return [1.0 for _ in completions]


def two_args(rewards, extra):  # a filter takes one list of rewards
    return True


class Score:  # a class is not a reward: Score(completion, answer) builds an object, not a float
    def __init__(self, completion, answer):
        self.value = 1.0


class NoPredict:  # a ranker needs predict() and observe()
    def observe(self, prompts, lengths):
        pass


class NoLoraEngine:  # an engine whose constructor takes no `lora`: it cannot apply a train.lora version
    def __init__(self, model_dir, **common):
        self.model_dir = model_dir
