"""The frontend language: SGLang programs (gen, select, fork, roles) over sgjax backends."""
