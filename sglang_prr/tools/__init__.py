"""Tools around the core, none of them on the decode path: the models the server and the tests
run (``models``: SmolLM2 fetched and converted; ``demo``: the tiny random-weight model;
``peaked_llama``: a checkpoint whose attention decides the logprobs), the budget profiler
(``profile_budget``), block-score traces (``traces``: format and recorder; ``trace_replay``: the
predictor replayed over them; ``trace_families``: synthetic ones) and a synthetic paged KV cache
(``synthetic``). They import the core and each other, never the serving layer or SGLang.
"""
