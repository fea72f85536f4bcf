"""Stage workers: the talker stage (AR, one frame per step) and the code2wav stage (chunks in, audio out).

``talker_eager`` runs the talker in plain torch in this process; the vLLM backend lives in its own
modules of this package and is the only code that imports vLLM.
"""
