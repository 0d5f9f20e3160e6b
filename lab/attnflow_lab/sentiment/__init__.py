"""The paper's Table 3 analogue: offline reviews, the shipped MiniLM fine-tuned on them.

* :mod:`~attnflow_lab.sentiment.sentiment`: a seeded generator of English-like reviews.
* :mod:`~attnflow_lab.sentiment.sentiment_torch`: the MiniLM classifier and its training.
* :mod:`~attnflow_lab.sentiment.reproduction_sentiment`: the Table 3 analogue.
"""

__all__: list[str] = []
