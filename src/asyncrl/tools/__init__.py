"""Tools for agentic RL: what a model may call, and what answers it.

- :mod:`asyncrl.tools.calls`: tool calls as the policy writes them, and the parsers that
  read them out of generated text (Hermes-style ``<tool_call>{json}</tool_call>`` by
  default), with the system text that shows a model its tools when its chat template
  cannot.
- :mod:`asyncrl.tools.base`: a :class:`~asyncrl.tools.base.Tool` (an OpenAI function
  schema plus an async callable), tools from Python functions, and the
  :class:`~asyncrl.tools.base.ToolBox` that runs calls and turns every failure into an
  observation with a reason.
- :mod:`asyncrl.tools.builtin`: the ``calculator`` and ``python`` tools.
- :mod:`asyncrl.tools.sandbox`: the limited subprocess the ``python`` tool runs code in.
- :mod:`asyncrl.tools.mcp`: the tools of an MCP server started over stdio.

The environments that run them in an episode (reset, step, reward) are
:mod:`asyncrl.workflows.tool_env`.
"""
