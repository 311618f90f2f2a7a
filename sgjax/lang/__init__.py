"""The frontend language: SGLang programs (gen, select, fork, roles) over sgjax backends.

Modules: ir (expressions), api (the public functions), interpreter (stream executors, fork/join, run/run_batch),
tracer (compiler mode), choices (select methods), chat_template (role markers), backend/ (the model side).
"""
