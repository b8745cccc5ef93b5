# app.py: an example of your own code on an edgebroker gateway.
#
#   edgebroker flash esp32 --port /dev/ttyUSB0 --app examples/app.py   # on a board (/app.py)
#   edgebroker emulate esp32 --app examples/app.py                     # on this machine
#
# The gateway imports /app.py and runs `await main(broker)` as an asyncio
# task beside the broker (README.md "Your code on the gateway"). `broker` is
# the running edgebroker.Broker; this file uses only its local client:
#
#   - a sensor loop publishes a (fake) temperature every second as a retained
#     message on sensors/<NAME>/temperature: a client that subscribes later
#     gets the last reading at once;
#   - a command handler subscribed to cmd/<NAME>/# acts on
#       cmd/<NAME>/led       "on" / "off": prints it and publishes the new
#                            state retained on state/<NAME>/led
#       cmd/<NAME>/interval  seconds between readings, 0.1 .. 3600
#
# Try it (emulate --port 1883):
#   mosquitto_sub -p 1883 -t 'sensors/#' -t 'state/#' -v
#   mosquitto_pub -p 1883 -t cmd/gw1/led -m on
#   mosquitto_pub -p 1883 -t cmd/gw1/interval -m 5
#
# If main() raises, the broker goes on serving; the crash is printed and
# counted (and, at boot, counts toward safe mode); main() is not restarted
# until the next reset.

import asyncio

try:  # only the type checker has typing
    from typing import Any
except ImportError:
    pass

NAME = "gw1"  # this gateway's name in topics: give each gateway its own
READING = "sensors/" + NAME + "/temperature"
LED_STATE = "state/" + NAME + "/led"
COMMANDS = "cmd/" + NAME + "/"


class Sensor:
    """A stand-in for a real sensor: a slow, bounded random walk around 21 C.
    (On a board, read a machine.ADC or a DS18X20 here instead.)"""

    def __init__(self) -> None:
        self.value = 21.0
        self.seed = 12345

    def read(self) -> float:
        self.seed = (self.seed * 1103515245 + 12345) & 0x7FFFFFFF  # no `random` needed
        step = (self.seed % 21 - 10) / 100  # -0.10 .. +0.10
        self.value = min(max(self.value + step, 15.0), 30.0)
        return self.value


async def main(broker: "Any") -> None:
    settings = {"interval": 1.0}

    def on_command(
        topic: str, payload: bytes, retained: bool, properties: "dict[str, Any]"
    ) -> None:
        # Called from the event loop: keep it short, never block (no sleep).
        # A command kept retained from before a reset applies as well.
        what = topic[len(COMMANDS) :]
        text = payload.decode()
        if what == "led" and text in ("on", "off"):
            print("app: led " + text)  # a real board: machine.Pin(...).value(text == "on")
            broker.publish(LED_STATE, text, qos=1, retain=True)
        elif what == "interval":
            try:
                seconds = float(text)
            except ValueError:
                seconds = 0.0
            if 0.1 <= seconds <= 3600:
                settings["interval"] = seconds
                print("app: interval %s s" % text)
            else:
                print("app: interval %r ignored (0.1 .. 3600 s)" % text)
        else:
            print("app: unknown command %s %r" % (topic, text))

    handle = broker.subscribe(COMMANDS + "#", on_command, qos=1)
    sensor = Sensor()
    try:
        while True:
            broker.publish(READING, "%.2f" % sensor.read(), qos=1, retain=True)
            await asyncio.sleep(settings["interval"])
    finally:  # cancelled (Ctrl-C) or crashed: the handler goes with the app
        broker.unsubscribe(handle)
