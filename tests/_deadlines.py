"""How long the tests wait before they call something hung (caller side only).

No test may depend on how fast the machine is. A test therefore checks a library's time
promise ("a call fails once its timeout has passed") by what can be seen at any speed: the
failure is the timeout's own error, it comes while the fault still holds (the test releases a
frozen host only after the outcome is in), and never before the timeout (lower bounds hold on
any machine). The only upper bounds on wall time are the guards below: they tell a hang from a
slow machine, so they are generous, and reaching one is a failure, never a pass.

A machine with 2 cores beside 18 busy loops runs each of its processes at about a tenth of a
core: starting a world of five interpreters that import torch then takes minutes, not seconds.
"""

#: Starting a world: spawning its processes, importing torch, init_rpc, the first create call.
SETUP_S = 600.0

#: Any single wait that ends when something happens (a call settles, a process exits, a gate
#: opens): reaching this means the thing never happened.
HANG_S = 300.0
