"""What zerokern runs on: the device handle (device.py) and facts about the host machine."""
