"""Adapters: ACP v2 agents over runtimes that own the session store.

Each adapter lives in a module of its own behind an optional extra, so the core never imports
the runtime it wraps:

- `acp_once.adapters.langgraph` (`pip install 'acp-once[langgraph]'`): sessions are LangGraph
  threads in a checkpointer, keyed prompts found again by their derived message id
  (`acp_once.agent.adapter.AdapterKeys`).
"""
