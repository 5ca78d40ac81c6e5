"""`swarm export`: the trained model, scattered over peers one stage each, as one model folder.

config.py    ExportConfig (flags and SWARM_* variables)
live.py      every stage's replicas downloaded from the live swarm (the state RPC)
offline.py   every stage read from peers' checkpoint folders
assemble.py  pure: the most-trained replica per stage, the checks that the stages fit, global names
run.py       the command: gather, check, write the folder (models/hf_format.py) atomically
"""
