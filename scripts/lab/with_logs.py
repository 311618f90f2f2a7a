"""Run a script with sgjax's INFO logs on stderr (start-up compile times, failed steps): python with_logs.py S ARGS"""
import logging
import runpy
import sys

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
logging.getLogger("sgjax").setLevel(logging.INFO)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
