"""The compiled parts, each the per-block loop of one pure-Python module, which stays the reference and the
fallback: router/_fastkeys.c (chained block keys), router/index/_fastdicts.c (the dict index's store and remove
loops and its match walk), router/index/_fastcompact.c (the compact index's store and remove loops),
router/scheduling/_fastghosts.c (the reuse statistics' ghost list), router/events/_fasttokens.c (an event's
token ids read from their msgpack bytes), router/scheduling/_fastobjective.c (the routing objective's
per-candidate arithmetic, built with no fused multiply-adds so it rounds as numpy does) and sim/_fastworkload.c
(a trace row's synthesised prompt tokens); their headers say why.
Optional: where no C compiler is found the build goes on without them."""

from setuptools import Extension, setup

SHARED = ["router/_xxh3.h"]  # XXH3 and token reading, included by _fastkeys.c and _fastdicts.c (shipped by MANIFEST.in)

setup(ext_modules=[Extension(name, [source], optional=True, extra_compile_args=["-O2"], depends=SHARED)
                   for name, source in (("router._fastkeys", "router/_fastkeys.c"),
                                        ("router.index._fastdicts", "router/index/_fastdicts.c"),
                                        ("router.index._fastcompact", "router/index/_fastcompact.c"),
                                        ("router.scheduling._fastghosts", "router/scheduling/_fastghosts.c"),
                                        ("router.events._fasttokens", "router/events/_fasttokens.c"),
                                        ("sim._fastworkload", "sim/_fastworkload.c"))]
            + [Extension("router.scheduling._fastobjective", ["router/scheduling/_fastobjective.c"], optional=True,
                         extra_compile_args=["-O2", "-ffp-contract=off"])])
