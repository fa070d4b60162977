"""The defaults more than one component reads: the CLI's flags, the proxy's and the workers'
frozen configs, the planner and the splitter's tool cuts all take them from here, so that a
default changes in one place. Imports nothing (the proxy-only install and the workers both
load it)."""

from __future__ import annotations

# Tokens between tool anchors inside the instruction prefix: a toolset that starts with
# another one's first tools restores that part, at the price of one prefill round per anchor
# (6 on the 31-tool BFCL toolset); 256 halves what is left unrestored and doubles the rounds.
TOOL_ANCHOR_GAP_TOKENS = 512

# Anchor slots in a worker's slot table (a quarter of them the thin region of instruction and
# tool anchors): one anchor per turn keeps a few dozen agent conversations' chains.
ANCHOR_SLOTS = 256

# Host memory a worker's anchor slabs may take: tens of thousands of tokens of a small
# model's KV, within an ordinary machine's RAM beside the model.
ANCHOR_BYTES = 4 << 30

# Anchor bytes all pinned toolsets may hold together: a quarter of ANCHOR_BYTES, so pins never
# crowd out the conversations' anchors.
PIN_BUDGET_BYTES = 1 << 30

# Anchor bytes all `cache_control` TTL leases on one worker may protect together (and never
# more than half of its anchor memory): like the pins, a quarter of ANCHOR_BYTES.
LEASE_BUDGET_BYTES = 1 << 30

# The thin region of the slot table: slots for toolsets' instruction and tool anchors, which
# pins keep; the rest (the thick region) hold conversation, prompt-end and response anchors.
PINNED_SLOTS = ANCHOR_SLOTS // 4

# A caller's conversations in flight at once that the proxy's per-caller memos follow (the
# splitter's kept turns and message lists, the planner's key states): an agent's next turn
# extends its last one only while that is kept, so a tenant running more agents than this at
# once renders, tokenizes and keys each of their prompts whole.
CONVERSATIONS_PER_SCOPE = 128
