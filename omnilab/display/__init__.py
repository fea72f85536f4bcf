"""Display: plots, audio players and the live streaming panel; renders data, computes nothing.

Every plot takes data (a ``Trace``, a DataFrame, audio) and ``ax=None`` and returns the artist it drew on
(``plots``); ``live`` is the streaming player panel (an anywidget, front end in ``live_player.js``). matplotlib,
IPython and anywidget are imported inside the functions, so importing this package stays light.

May import: ``instrument`` (the data it renders), the leaves, and ``results`` for type checks. Nothing imports
``display`` but notebooks, the CLI and benchmarks.
"""
from omnilab.display.live import LivePlayer, live_stream
from omnilab.display.plots import *  # noqa: F401,F403
from omnilab.display.plots import __all__ as _plots_all

__all__ = [*_plots_all, "LivePlayer", "live_stream"]
