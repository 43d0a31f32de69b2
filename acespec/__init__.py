"""AceSpec: speculative decoding across an edge device and a cloud GPU.

The package is laid out in layers (`LAYERS`, lowest first); a module imports only modules of its own layer
entry or of the layers below it, never one above, and layers that share an entry (`cloud` and `edge`,
say) do not import each other. No import cycles, not even through imports inside functions.
`tests/test_layers.py` enforces all of it.

    argtypes, tls, env -> net -> models -> verify -> draft -> control -> wire -> loop -> config, cli_output
    -> cloud | edge -> eval -> sim -> bench -> cli -> demo
"""

__version__ = "0.1.0"

# The layers, lowest first. Each entry names top-level modules or subpackages of acespec; the names in one
# entry are siblings, which may not import each other. Why this order:
# - argtypes (argparse value types), tls (TLS contexts) and env (the environment variables, read in one
#   place) use the standard library only: any layer may use them; so does net (the WAN emulator and the
#   link profiles), which imports nothing else of AceSpec;
# - models, verify, draft, control and wire need nothing above them; loop (the draft -> verify loop
#   written once) drives models, rules, drafters and depth policies;
# - config (each role's settings as dataclasses, the flags generated from them) and cli_output (how the
#   command line prints text) sit below the roles that use them; cloud and edge each speak the wire
#   around the loop, and neither imports the other;
# - eval (the length-inflation harness) runs the loop and cloud's vLLM plugin; sim replays the edge's
#   loop on virtual time and reads eval's data sets when it records traces; bench measures all of it; cli
#   (the command line) sits on top, and demo (`acespec demo`) above it: it reads cli's error and option
#   types, and cli loads it by name only when the subcommand runs.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("argtypes", "tls", "env"),
    ("net",),
    ("models",),
    ("verify",),
    ("draft",),
    ("control",),
    ("wire",),
    ("loop",),
    ("config", "cli_output"),
    ("cloud", "edge"),
    ("eval",),
    ("sim",),
    ("bench",),
    ("cli",),
    ("demo",),
)
