"""The error every grammar compiler raises (a 400 naming the field at the server)."""


class GrammarError(ValueError):
    """A grammar this compiler cannot turn into a finite automaton (or one that is too large, or too slow to build)."""
