"""Ask a running `paratrain serve` for predictions: python serving_client.py http://127.0.0.1:8000"""

import json
import sys
import urllib.request

url = sys.argv[1]
rows = [[1.0] * 10 + [0.0] * 10, [-1.0] * 10 + [0.0] * 10]  # two rows of 20 features
request = urllib.request.Request(
    url + "/predict",
    data=json.dumps({"inputs": rows}).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=30) as response:
    answer = json.load(response)
classes = [max(range(len(out)), key=out.__getitem__) for out in answer["outputs"]]
print(f"model step {answer['model_step']}: classes {classes}, outputs {answer['outputs']}")
