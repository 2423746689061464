"""The program configs the suite shares (each is exported once per session by the ``program_factory`` fixture)."""

from shared.manifest import ProgramConfig

# The tiny model's device programs: one query and four queries, E = 2, 16 columns of which the last 2 are answers.
TINY_Q1 = ProgramConfig(q=1, batch_size=2, seq_len=16, answer_len=2, rank=4, alpha=8.0)
TINY_Q4 = ProgramConfig(q=4, batch_size=8, seq_len=16, answer_len=2, rank=4, alpha=8.0)
