"""`Function.compile()`: a program traced once into its graph (tracer.py), then run by executing the graph.

The program's Python code runs once, at compile time, on abstract arguments; a run replays the graph's nodes in
order (node ids are a topological order: a node is recorded after everything it reads), each on its stream's
executor: constant nodes submit the expressions that made their text (text pieces, role markers, var scopes), so
the run backend's own chat template applies; an argument node submits the run's value; gen, select, image and
separate_reasoning nodes submit their expressions; a variable node appends another stream's variable once it
exists; a fork node forks its stream's executor and its get_fork_item nodes name the branches; a join joins them.
A stream that starts without a fork is a called sgl function's own program (tracer.trace_call) and gets an
executor of its own. Streams run concurrently as in interpreter mode; the result is the main stream's state.

`run_batch` pre-caches the graph's constant prefix (when long enough) and replays once per argument dict.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from sgjax.lang.backend.default import resolve_backend
from sgjax.lang.global_config import global_config
from sgjax.lang.interpreter import ProgramState, StreamExecutor, _ReadVar
from sgjax.lang.ir import Constant, Expr, split_run_kwargs


class CompiledFunction:
    def __init__(self, function, graph):
        self.function = function
        self.graph = graph
        self.arg_names = [n.label for n in graph.stream(0) if n.kind == "argument"]  # still abstract
        self.last_node = graph.last_node

    def print_graph(self) -> None:
        print(self.graph)

    def run(self, *, backend=None, **kwargs) -> ProgramState:
        """Run the graph with these arguments (every argument that was abstract at compile time) and sampling
        defaults (run()'s keywords)."""
        sampling, program = split_run_kwargs(kwargs)
        return self._replay(resolve_backend(backend), program, sampling)

    def run_batch(self, batch_kwargs, *, backend=None, num_threads="auto", **sampling) -> list[ProgramState]:
        backend = resolve_backend(backend)
        defaults, _ = split_run_kwargs(sampling)
        batch = list(batch_kwargs)
        if not batch:
            return []
        prefix = self.graph.prefix()
        if (
            len(batch) > 1
            and global_config.enable_precache_with_tracing
            and len(prefix) >= global_config.precache_min_chars
        ):
            backend.cache_prefix(prefix)
        workers = max(1, min(len(batch), 32 if num_threads == "auto" else int(num_threads)))

        def one(kwargs):
            state = self._replay(backend, dict(kwargs), defaults)
            state.sync()
            return state

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, batch))

    def _replay(self, backend, kwargs: dict, defaults: dict) -> ProgramState:
        values = {**self.function.bind_arguments, **kwargs}
        missing = [n for n in dict.fromkeys(self.arg_names) if n not in values]
        if missing:
            raise TypeError(f"compiled {self.function.name}: give argument(s) {missing}")
        nodes = self.graph.nodes
        main = StreamExecutor(backend, defaults)
        executors, roots, branches = {0: main}, [main], {}
        try:
            for node in nodes:
                exe = executors.get(node.stream)
                if exe is None:
                    if node.kind == "get_fork_item":  # a branch: its executor came from the fork
                        exe = branches[node.sources[0]][int(node.label)]
                    else:  # a called function's program
                        exe = StreamExecutor(backend, defaults)
                        roots.append(exe)
                    executors[node.stream] = exe
                self._submit(node, exe, executors, branches, values)
        finally:
            for exe in roots:
                exe.end()
        return ProgramState(main)

    def _submit(self, node, exe, executors, branches, values) -> None:
        where = node.where
        if node.kind == "argument":
            value = values[node.label]
            exe.submit(value if isinstance(value, Expr) else Constant(str(value)), where)
        elif node.kind == "variable":
            source = self.graph.nodes[node.sources[0]]
            exe.submit(_ReadVar(executors[source.stream], node.label), where, names=())
        elif node.kind == "fork":
            size = int(node.label)
            branches[node.id] = exe.fork(size, size > 1 and global_config.enable_frontend_hint, where)
        elif node.kind == "join":
            exe.join([executors[self.graph.nodes[s].stream] for s in node.sources], node.label, where)
        elif node.kind != "get_fork_item":  # constant, gen, select, image, video, separate_reasoning
            for expr in node.exprs:
                exe.submit(expr, where)

    def __repr__(self):
        return f"CompiledFunction({self.function.name}: {len(self.graph.nodes)} nodes)"
